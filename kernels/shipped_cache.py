"""Compiled kernels shipped with the code (issue 41: nothing compiles inside a task on a known GPU
kind). `kernels/triton_cache/sm<CC>-triton<VERSION>.tar.gz` is a Triton cache directory as a
device filled it (the executor's training, evaluation and decode kernels, with their autotuning
choices); a process that is about to run the engine on such a GPU with that Triton version copies
the entries its own cache lacks into it (`seed`), once per cache directory. Triton then loads those
kernels instead of compiling them: each kernel's group file, which Triton writes with the
compiling directory's absolute paths, is rewritten to the directory it lands in (else Triton takes
the entry for a miss and compiles it again). An entry of the cache is keyed by the kernel's source, its
specialisation, the compiler and the device: an archive from other sources only adds entries
nobody asks for, never a wrong kernel.

Refreshing an archive (after the kernels change): on the device, run search (a) and the tasks on a
cache seeded from the archive and bring the grown cache back (bench/device_session.sh's
`search_then_task`), then `python -m kernels.shipped_cache --merge GROWN.tar.gz` (`merge`: the
entries of kernels changed since the manifest dropped, the new ones added, the manifest written).
Kernels whose compiled forms depend only on their row width and dtype (kernels.norm_act's norms) can be
compiled for every width on an empty cache instead (bench/norm_cache.py) and that cache merged the same way. The manifest names, per
archive, its digest and every kernel's fingerprint (`kernel_fingerprints`) at the time it was made;
tests/unit/test_shipped_cache.py fails where a kernel changed since, or moved: Triton's cache key
holds a kernel's first line, so lines added above a kernel make every shipped entry of it a miss
(session 36: 14 lines of configurations above the fused kernels, 39 kernels compiled inside
search (a) on an H100)."""

from __future__ import annotations

import argparse
import hashlib
import importlib
import inspect
import io
import json
import logging
import os
import tarfile
from pathlib import Path, PurePosixPath

log = logging.getLogger("loraplex.kernels.shipped_cache")
ARCHIVES = Path(__file__).resolve().parent / "triton_cache"
MARKER_PREFIX = ".loraplex-shipped-"
MANIFEST = ARCHIVES / "manifest.json"
# the modules whose Triton kernels (and the helpers they call) the archives hold
KERNEL_MODULES = ("kernels.fused_lora", "kernels.triton_lora", "kernels.norm_act", "kernels.rope", "kernels.cross_entropy")


def cache_dir() -> Path:
    """The directory Triton compiles into in this process: $TRITON_CACHE_DIR, else its default."""
    env = os.environ.get("TRITON_CACHE_DIR")
    return Path(env) if env else Path.home() / ".triton" / "cache"


def archive_name(capability: tuple[int, int], triton_version: str) -> str:
    return f"sm{capability[0]}{capability[1]}-triton{triton_version}.tar.gz"


def archive_digest(path: Path) -> str:
    """An archive's identity: the seed's marker and the manifest name it by this."""
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def device_key() -> tuple[tuple[int, int], str] | None:
    """(compute capability, Triton version) of this process's GPU, or None without CUDA/Triton."""
    try:
        import torch
        import triton
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability()), triton.__version__  # type: ignore[return-value]


def _entry_path(name: str) -> PurePosixPath | None:
    """An archive member's path inside the cache (its leading `triton/` folder dropped), or None
    for anything that would land outside it."""
    parts = [p for p in PurePosixPath(name).parts if p not in ("", ".")]
    if parts and parts[0] == "triton":
        parts = parts[1:]
    if not parts or any(p == ".." for p in parts) or PurePosixPath(name).is_absolute():
        return None
    return PurePosixPath(*parts)


def seed(target: Path | None = None, key: tuple[tuple[int, int], str] | None = None,
         archives: Path = ARCHIVES) -> int:
    """Copy the shipped archive of this GPU kind and Triton version into the cache directory
    (default: this process's), adding only files it lacks; the number of files added. Nothing
    happens without a matching archive, or when the directory already took this archive (a marker
    file names its digest). Never raises for a cache it cannot write: Triton then compiles."""
    key = key if key is not None else device_key()
    if key is None:
        return 0
    archive = archives / archive_name(*key)
    if not archive.is_file():
        return 0
    target = target if target is not None else cache_dir()
    try:
        digest = archive_digest(archive)
        marker = target / f"{MARKER_PREFIX}{digest}"
        if marker.exists():
            return 0
        added = 0
        with tarfile.open(archive, "r:gz") as tar:
            for member in tar:
                rel = _entry_path(member.name)
                if rel is None or not member.isfile():
                    continue
                dest = target.joinpath(*rel.parts)
                group = dest.name.startswith("__grp__") and dest.suffix == ".json"
                if dest.exists() and (not group or _group_whole(dest)):  # a broken group is replaced
                    continue
                dest.parent.mkdir(parents=True, exist_ok=True)
                src = tar.extractfile(member)
                if src is None:
                    continue
                data = src.read()
                if group:
                    data = _group_here(data, dest.parent)
                tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")  # a reader never sees a part
                tmp.write_bytes(data)
                os.replace(tmp, dest)
                added += 1
        marker.touch()
    except OSError as exc:
        log.warning("shipped Triton cache not copied: %s", type(exc).__name__)
        return 0
    if added:
        log.info("shipped Triton cache: %d files added from %s", added, archive.name)
    return added


def _group_here(data: bytes, entry_dir: Path) -> bytes:
    """A kernel's group file (`__grp__<name>.json`) pointing at its files in `entry_dir`. Triton
    writes each child's absolute path, i.e. the cache directory of the device that compiled it,
    and takes an entry whose children are not at those paths for a miss: it compiled every shipped
    kernel again in any other directory (bench/results/session27_h100.md)."""
    try:
        grp = json.loads(data)
        children = grp.get("child_paths")
    except (ValueError, AttributeError):  # not a group Triton wrote: copied as it is
        return data
    if isinstance(children, dict):
        grp["child_paths"] = {name: str(entry_dir / PurePosixPath(str(path)).name) for name, path in children.items()}
    return json.dumps(grp).encode()


def _group_whole(path: Path) -> bool:
    """Whether every file a group file names exists (what Triton checks before it uses the entry)."""
    try:
        children = json.loads(path.read_text()).get("child_paths")
    except (OSError, ValueError, AttributeError):
        return False
    return isinstance(children, dict) and all(os.path.exists(p) for p in children.values())


def kernel_fingerprints(modules: tuple[str, ...] = KERNEL_MODULES) -> dict[str, list]:
    """Every Triton kernel defined in `modules` (the JIT functions, compiled or interpreted):
    "module.name" -> [a digest of its source, its first line]. Triton keys a compiled kernel by
    both (and by the keys of the kernels it calls), so a shipped entry serves only while neither
    changed."""
    out: dict[str, list] = {}
    for name in modules:
        for attr, obj in vars(importlib.import_module(name)).items():
            fn = getattr(obj, "fn", None)
            if type(obj).__name__ not in ("JITFunction", "InterpretedFunction") or not inspect.isfunction(fn):
                continue
            if fn.__module__ != name:  # a helper imported from another module: listed under its own
                continue
            lines, first = inspect.getsourcelines(fn)
            out[f"{name}.{attr}"] = [hashlib.sha256("".join(lines).encode()).hexdigest()[:16], first]
    return dict(sorted(out.items()))


def write_manifest(archives: Path = ARCHIVES, manifest: Path = MANIFEST) -> dict:
    """The manifest of the archives present, from the kernels as they are now (run right after the
    archives were refreshed from these kernels)."""
    kernels = kernel_fingerprints()
    body = {path.name: {"sha256": archive_digest(path), "kernels": kernels}
            for path in sorted(archives.glob("*.tar.gz"))}
    manifest.write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")
    return body


def _entries(tar: tarfile.TarFile) -> dict[str, list[tuple[tarfile.TarInfo, PurePosixPath]]]:
    """An archive's (or a returned cache's) entries: entry folder -> its files (markers and files
    outside an entry folder left out)."""
    out: dict[str, list[tuple[tarfile.TarInfo, PurePosixPath]]] = {}
    for member in tar:
        rel = _entry_path(member.name)
        if rel is not None and member.isfile() and len(rel.parts) == 2:
            out.setdefault(rel.parts[0], []).append((member, rel))
    return out


def stale_kernels(made_from: dict[str, list], now: dict[str, list], compiled: set[str]) -> set[str]:
    """The compiled kernels (their function names, as their entry files are named) whose entries no
    longer serve: a kernel whose source or first line changed, and every kernel of a module whose
    helper (a JIT function no entry is named by: Triton keys the kernels calling it by its source
    too) changed or went."""
    stale: set[str] = set()
    for qual, fp in made_from.items():
        if now.get(qual) == fp:
            continue
        module, name = qual.rsplit(".", 1)
        stale |= {name} if name in compiled else {q.rsplit(".", 1)[1] for q in made_from if q.startswith(module + ".")}
    return stale


def merge(grown: Path, archive: Path, manifest: Path = MANIFEST) -> dict[str, int]:
    """Refresh `archive` from a cache a device grew from it (bench/device_session.sh returns one as
    triton_cache_sm90.tar.gz): its entries of kernels changed since the manifest was written are
    dropped (`stale_kernels`), every entry the device compiled (written after the seed's marker) that
    it lacks is added, and the manifest is written again. Members are written in sorted order with neutral owners."""
    made_from = json.loads(manifest.read_text()).get(archive.name, {}).get("kernels", {})
    with tarfile.open(archive, "r:gz") as tar:
        old = {d: [(m, r, tar.extractfile(m).read()) for m, r in files] for d, files in _entries(tar).items()}
    compiled = {PurePosixPath(r.name).stem for files in old.values() for _, r, _ in files
                if not r.name.startswith("__grp__")}
    stale = stale_kernels(made_from, kernel_fingerprints(), compiled)
    keep = {d: f for d, f in old.items() if not any(PurePosixPath(r.name).stem in stale for _, r, _ in f)}
    with tarfile.open(grown, "r:gz") as tar:
        # what the seed copied in (no later than its marker) is not a compile of this code: a cache
        # seeded from another archive holds that archive's entries, stale ones included
        seeded = max((m.mtime for m in tar.getmembers() if PurePosixPath(m.name).name.startswith(MARKER_PREFIX)),
                     default=-1)
        new = {d: [(m, r, tar.extractfile(m).read()) for m, r in files]
               for d, files in _entries(tar).items() if d not in old and max(m.mtime for m, _ in files) > seeded}
    body = {**keep, **new}
    tmp = archive.with_name(f".{archive.name}.{os.getpid()}.tmp")
    with tarfile.open(tmp, "w:gz") as out:
        for d in sorted(body):
            for m, r, data in sorted(body[d], key=lambda f: f[1].name):
                info = tarfile.TarInfo(f"triton/{d}/{r.name}")
                info.size, info.mtime, info.mode = len(data), int(m.mtime), 0o644
                out.addfile(info, io.BytesIO(data))
    os.replace(tmp, archive)
    write_manifest(archive.parent, manifest)
    return {"kept": len(keep), "dropped": len(old) - len(keep), "added": len(new)}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="the shipped Triton archives' manifest")
    ap.add_argument("--manifest", action="store_true", help=f"write {MANIFEST.name} from the kernels as they are")
    ap.add_argument("--merge", type=Path, help="a Triton cache (.tar.gz) a device grew from the archive: "
                    "the archive refreshed from it (stale entries dropped, new ones added) and the manifest written")
    ap.add_argument("--archive", default="sm90-triton3.6.0.tar.gz", help="the archive --merge refreshes")
    args = ap.parse_args()
    if args.merge:  # merge writes the manifest itself
        print(merge(args.merge, ARCHIVES / args.archive))
    elif args.manifest:
        print(", ".join(f"{k}: {len(v['kernels'])} kernels" for k, v in write_manifest().items()))
