"""The introspection and measuring tools, above the engine: they run a Model or read a
ColibriFile, the engine never needs them.

    trace       routing as data: the experts each token chose (Trace, iter_trace, trace,
                routing_stats)
    stats       expert statistics folded from traces, chunk by chunk (RoutingStats)
    display     notebook HTML of Model, Trace and RoutingStats (`_repr_html_`)
    plot        matplotlib figures of routing (matplotlib optional)
    inspect     what is inside a .colibri file (`colibri inspect`)
    fidelity    routing of a quantized model against its base, per MoE layer (RoutingFidelity,
                compare_routing, routing_fidelity)
    perplexity  perplexity over a text, KL against a base model (`colibri perplexity`), and
                the routing fidelity of the same passes
    bench       prompt and generation speed, llama-bench style (`colibri bench`)

Imports run one way, downward: inspect at the bottom (over the file format), display over
inspect, stats over display, trace over stats (and the engine), plot over trace and stats;
bench over inspect and the engine, fidelity over trace, perplexity over fidelity and the
engine. The engine imports none of them (Model._repr_html_ reaches display when a notebook
asks).
"""
