"""Unit: which target linears form sibling groups (trainer.multilora, $LORAPLEX_LORA_GROUPS), that their offsets
reach the kernels as one view of the layers' offset rows, and that outputs kept for siblings do not outlive a
forward that stopped short. The grouped kernels' numbers: tests/slow/test_lora_groups_interpret.py."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from tests.helpers.engine_ref import tiny_model_dir
from trainer import multilora
from trainer.engine import MultiLoraEngine
from trainer.jobs import TrainJob


def _groups(layers: dict) -> list[list[str]]:
    seen, out = set(), []
    for layer in layers.values():
        if layer.group is not None and id(layer.group) not in seen:
            seen.add(id(layer.group))
            out.append([m.name.rsplit(".", 1)[1] for m in layer.group.members])
    return out


def test_each_layers_q_k_v_and_gate_up_form_groups_in_module_order(tmp_path) -> None:  # noqa: ANN001
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama", tmp_path))
    layers = multilora.inject_multilora(model, ["v_proj", "q_proj", "k_proj", "o_proj", "up_proj", "gate_proj",
                                                "down_proj"])
    n = model.config.num_hidden_layers
    assert _groups(layers) == [["q_proj", "k_proj", "v_proj"], ["gate_proj", "up_proj"]] * n
    assert all(layers[k].group is None for k in layers if k.endswith(("o_proj", "down_proj")))


def test_two_targets_of_a_set_group_and_one_alone_does_not(tmp_path) -> None:  # noqa: ANN001
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama", tmp_path))
    layers = multilora.inject_multilora(model, ["q_proj", "v_proj", "up_proj"])
    assert _groups(layers) == [["q_proj", "v_proj"]] * model.config.num_hidden_layers
    assert all(layers[k].group is None for k in layers if k.endswith("up_proj"))


def test_siblings_offsets_are_one_view_of_the_layers_rows_and_kept_outputs_go_with_the_layout(tmp_path) -> None:  # noqa: ANN001
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama", tmp_path))
    eng = MultiLoraEngine(model, [], 0)
    for name, rank in (("a", 4), ("b", 8)):
        eng.attach(TrainJob(name, lora_rank=rank, batch_size=1))
    states = list(eng.jobs.values())
    eng.slots.set_layout(states, [0, 3, 7])
    group = next(m.group for m in eng.layers.values() if m.group is not None)
    rows = multilora._rows([m.a_off for m in group.members])
    assert rows.data_ptr() == group.members[0].a_off.data_ptr() and rows.shape == (3, 2)  # a view, no copy
    assert torch.equal(rows, torch.stack([m.a_off for m in group.members]))
    # a row of another tensor (or out of order) is stacked instead
    odd = [group.members[0].a_off, group.members[1].a_off.clone(), group.members[2].a_off]
    assert torch.equal(multilora._rows(odd), torch.stack(odd))
    assert multilora._rows(odd[::-1]).data_ptr() != odd[2].data_ptr()
    # outputs kept for siblings not yet called (a forward that raised between them) leave with the layout
    group._kept = (torch.zeros(1), True, {1: torch.zeros(1)})
    eng.slots.clear_layout()
    assert group._kept is None
