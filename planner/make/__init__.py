"""``make``: its inputs parsed once, the model record every search shares, and the Plan assembled from the choice."""
