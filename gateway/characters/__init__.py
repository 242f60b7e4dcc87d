"""``/v1/characters`` and ``/v1/sessions``, and chats answered in character."""
