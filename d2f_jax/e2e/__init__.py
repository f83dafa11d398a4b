"""The miniature D2F reproduction behind `python -m d2f_jax.main`: data, training stages, evaluation, report."""
