"""Links that move arrays between peers: in-process threads (``inproc``); ZeroMQ comes with multi-node."""
