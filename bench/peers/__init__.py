"""One module per tool, each a small script written the way a user of that tool would write it.

Every peer is run as ``python -m bench.peers.NAME`` with the arguments of ``common.peer_args``
(source, dataset, output, chunks, levels, method, slab, workers, result file). Each imports its
libraries first and then times only the conversion (cluster start and stop included), writing
``{"seconds": …, "extra": {…}}`` to the result file. The suite times the whole process as well.
"""
