"""The engine: one forward pass over a batch, from token ids to logits.

model (Model: load, forward, the decode step), layer_loop (the one layer loop and its row
descriptions: the padded batch, ragged segments, the one-token step), ragged, decode_layer
(the compiled step's binding), attention / mla (the attention variants behind one interface),
moe / routing (the experts' layer and its router), norms, rope, kv_cache / run_state (the
cache and the run state it owns), prefix_cache (K/V blocks kept across requests), checks
(the arguments and NaN / cache guards of a call).
"""
