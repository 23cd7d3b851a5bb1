"""The processes of a sequence-parallel request: the process group, head slices and
all-to-all exchanges (`distributed`), and running the ranks under torchrun as one command
that leaves no process behind (`launch`). The runtime's lowest package.
"""
