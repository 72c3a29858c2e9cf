"""The service's infrastructure floor: settings (config), database engines and sessions (db),
the API's error type and handlers (errors), keyset pages (pagination), blob storage, the leader
election, the model registry and the local PostgreSQL/Redis for dev and tests (localstack).
It imports nothing else of the service: the domain and service.api build on it."""
