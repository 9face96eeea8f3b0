"""The introspection and measuring tools, above the engine: they run a Model or read a
ColibriFile, the engine never needs them.

    trace       routing as data: the experts each token chose (Trace, iter_trace, trace,
                routing_stats)
    stats       expert statistics folded from traces, chunk by chunk (RoutingStats)
    display     notebook HTML of Model, Trace and RoutingStats (`_repr_html_`)
    plot        matplotlib figures of routing (matplotlib optional)
    inspect     what is inside a .colibri file (`colibri inspect`)
    perplexity  perplexity over a text, KL against a base model (`colibri perplexity`)
    bench       prompt and generation speed, llama-bench style (`colibri bench`)

Imports run one way: display and inspect at the bottom, stats over display, trace over
stats, plot over both; perplexity and bench beside them, over the engine.
"""
