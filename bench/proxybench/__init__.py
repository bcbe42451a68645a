"""bench/proxy_bench.py by role: ``common`` (chunks, ports), ``upstreams`` (the paced SSE engine),
``peers`` (nginx, bare relays, the kvwatch role), ``clients`` (streams, bursts, keep-alive clients),
``scenarios`` (orchestration of steady, burst, flat and late-tail), ``report`` (the table); and for
bench/node_rate.py, ``cores`` (emulated cores: each process of a target in a capped CPU cgroup)."""
