"""Data: sources and loading, record formats, tokenizing with loss masks, the training mixture, packing,
and the sampler and loader. The modules, in pipeline order: ``sources`` -> ``loading`` -> ``records`` ->
``tokenize`` -> ``mixture`` -> ``packing`` -> ``loader``."""
