"""Host classes causalkv does not ship, served through causalkv's plugin registry."""
