"""The HTTP edge every route shares: middleware, auth, errors and the OpenAPI document."""
