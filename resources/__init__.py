"""Data kvchat ships: the demo model, the style sheet and the icon (installed as `kvchat_resources`)."""
