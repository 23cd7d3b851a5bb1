"""The files a run reads and writes: atomic output files and saved latents (`outputs`), the
video (`video`: VAE decoding, the encoders), and the checks of every file a request writes or
reads before anything loads (`file_checks`). Below the host; above `causalkv.runtime.model_io`.
"""
