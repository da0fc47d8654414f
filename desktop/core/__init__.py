"""The desktop app's Qt-free floor: the chat controller, reply stats, settings, the conversation store and
its file, import/export, Markdown, the context map's cells and the panel's words. Nothing here imports Qt
(tests/test_layering.py holds that), so tests drive it without a window."""
