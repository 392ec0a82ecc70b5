"""What requests carry, bounded before a backend sees it: wire types, texts, inline images and data URLs, chat
messages."""
