"""HTTP routes of the API, one module per area (files, tasks, internal, ops).
Routes are thin: parse, authorise, call one service function, return a schema."""
