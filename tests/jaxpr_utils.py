"""Looking inside traced programs: what a test asserts about the ops a function lowers to."""


def all_eqns(jaxpr):
  """Every equation of a jaxpr, those of nested jaxprs (jit, scan, cond, pallas bodies) included."""
  for eqn in jaxpr.eqns:
    yield eqn
    for param in eqn.params.values():
      inner = getattr(param, "jaxpr", param)
      if hasattr(inner, "eqns"):
        yield from all_eqns(inner)
