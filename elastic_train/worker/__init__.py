"""Worker side: a Ray actor per worker that runs the user's loop, generation after generation."""
