"""The int8 weight and everything that makes it behave (private).

In the order a weight meets them: :mod:`.meta` (``Int8WeightMeta``: everything a weight
carries besides its tensors, frozen), :mod:`.tensor` (``Int8Weight``: construction, rows,
pickling, the subclass protocol), :mod:`.pickle_layout` (what its pickle holds), :mod:`.op_table` (registration and dispatch) filled by
:mod:`.ops` (one module per role), :mod:`.linear` (``F.linear``), :mod:`.embedding`
(``F.embedding``) and :mod:`.experts` (what MoE expert code does with a 3-D weight), :mod:`.census` (how much of a model is int8), :mod:`.all_gather` (the FSDP2 hooks and their wire format),
:mod:`.conv1d` (GPT-2's ``Conv1D`` as an ``nn.Linear`` over the transposed weight),
:mod:`.tensor_parallel` (what a weight knows of a tensor-parallel split; writes that keep
row scales shared), :mod:`.update_checks` (the finiteness verdicts of updates),
:mod:`.end_of_step` (the work one optimizer step holds until it ends), :mod:`.tied_release`
(a table tied to the head freed once the head's backward has read it) and
:mod:`.cache_key` (the weight's key in torch.compile's AOTAutograd cache). ``fsdp_int8.weight`` is the public home of ``Int8Weight`` and ``Int8WeightMeta``.
"""
