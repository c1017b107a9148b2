"""The engine: its core and the process around it.

    engine.py        LLMEngine: admit, schedule, one forward, sample, report (scheduler.py,
                     batch.py, model_runner.py, sampler.py, output.py, logits_processors.py)
    loop.py          the loop every engine process runs (colocated and PD roles): receive, tick,
                     step, report; colocated.py the colocated engine's link and steps
    process.py       the colocated engine process; launcher.py starts and watches it
    client.py        the frontend's client of it, one `kvseal.engine_api.EngineBackend`
"""
