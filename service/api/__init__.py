"""The HTTP floor: the app factory (app), the dependencies every route shares (deps), request
authentication (auth), the routes (routes/, the async read path, downloads, the OpenAI-compatible
surface in openai_compat/, the dashboard in ui/), the OpenAPI document (openapi), the processes
that serve it (serve) and their background loops (background). Nothing below it imports it."""
