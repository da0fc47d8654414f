"""What is not the app at run time: the seam benchmark. The app never imports this package."""
