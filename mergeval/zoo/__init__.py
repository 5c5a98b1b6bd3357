"""Models mergeval builds itself: the tiny test model and fine-tuned domain experts."""
