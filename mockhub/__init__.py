"""A local stand-in for a model hub: the part of the Hugging Face Hub's HTTP API its client uses to learn what a
revision holds and to download files, able to throttle, cut connections and serve wrong bytes (mockhub.server).
Tests and benchmarks of staged weights use it; none reaches the internet."""
