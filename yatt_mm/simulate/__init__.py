"""`yatt-mm simulate`: a run's measured per-request timings replayed under another placement
(full or partial colocation), and scaled to a cluster with a device profile."""
