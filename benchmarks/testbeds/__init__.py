"""Where the readers read from: the emulated network (``netem``), the S3 server in its namespace with the
datasets on it (``world``), and the datasets themselves (``photos``)."""
