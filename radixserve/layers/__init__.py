"""Building blocks of the models: norms, rotary embedding, attention (backends), sampling."""
