"""What DisagMoE-DS can run, as data (pure Python: no torch, no transformers).

facts    one record per family (``FACTS``: model_type -> ``FamilyFacts``) that ``models`` and ``planner`` read
rules    every lever x lever and family x lever rule with its reason, the lines a refusal reads as, ``check``
uncut    families known and not cut yet, refused in one line naming their layers
"""
