"""`yatt-mm prep video|images`: raw videos or images -> WebDataset shards that `dataio` reads.

Modules, one job each: `inputs` (folders, globs, list files -> sorted items), `probe` (PyAV
metadata), `clips` (fixed stride or scene cuts), `frames` (decode, sample, rotate, resize),
`encode` (JPEG frames or an mp4 clip), `work` (one item -> encoded samples, or a failure),
`writer` (tar shards written as *.tar.tmp then renamed), `state` (resume journal), `runner`
(local process pool), `ray_runner` (Ray Data), `cli`.
"""
