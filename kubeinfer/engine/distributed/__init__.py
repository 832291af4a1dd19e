"""Tensor parallelism's machinery below the model: the process group and its collectives (parallel_state),
starting the other ranks' processes (launch), handing each step from rank 0 to them (step_channel) and
noticing when one dies (failure_watch). The layers that split a model across ranks are in
model_executor/layers/linear.py and vocab_parallel.py; the worker's loop is core/tp_worker.py."""
