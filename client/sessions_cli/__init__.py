"""``python -m muxworker.sessions DIR ...``: inspect and maintain a session store from the shell.

See ``__main__.py`` for the commands; everything goes through :class:`muxworker.client.SessionStore`
(opened with :meth:`~muxworker.client.SessionStore.inspect`, bound to no model).
"""
