"""The lab: kvplay's measurements, one module per feature (compare, memory, throughput, quality, inside,
tradeoffs, bench), on top of generate (the decode loop) and metrics (KL, top-1, perplexity).

Everything here takes a loaded model and checked, typed inputs, and returns a result from kvplay.results;
validation, model loading and the run's limits live one floor up, in kvplay.app.
"""
