"""Tools to check the engine against independent references on CPU gloo ranks, shared by the test suite and the
benchmarks: a pool of ranks (:mod:`.ranks`), the space of layout pairs and architectures (:mod:`.layout_space`) and
the check of one example of it (:mod:`.layout_check`). Not imported by the library itself."""
