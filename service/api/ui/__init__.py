"""The browser dashboard: static files (static/: plain HTML, CSS and JavaScript, no build step)
and the live view of one task that service.api.routes.ui streams as server-sent events."""
