"""Runnable examples: `python -m radixserve.examples.lesson` replays the lesson's radix cache example."""
