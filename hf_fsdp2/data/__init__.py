"""Data: sources and loading, record formats, tokenizing with loss masks, the training mixture, packing, and the sampler
and loader. The modules, in pipeline order: ``sources`` -> ``loading`` -> ``records`` -> ``tokenize`` -> ``mixture``
-> ``packing`` -> ``loader``; the record formats of the preference methods beside them: ``pairs`` (prompt / chosen /
rejected, shared by DPO, RM and KTO) and ``unpaired`` (KTO's prompt / completion / label)."""
