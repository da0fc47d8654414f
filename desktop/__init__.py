"""kvchat's desktop app: PySide6 widgets over the engine, which runs on one worker thread."""
