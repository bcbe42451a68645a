"""The node agent: wiring only. Config in, sources scheduled, servers started.

Every source runs as its own APScheduler job (asyncio): one job per replica scrape, one NVML poll
and one PID→GPU mapping job in worker threads, plus the event-driven sources (XID thread, proxy
listeners, OTLP receiver, SGLang file followers). A slow or dead replica only delays its own job;
``/metrics`` renders whatever the state holds now.
"""

from kvwatch.agent.runtime import Agent

__all__ = ["Agent"]
