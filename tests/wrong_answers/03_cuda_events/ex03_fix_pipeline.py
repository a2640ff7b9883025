# ruff: noqa: F821  (torch and events come from the notebook)
# Wrong: "fixed" by running both stages on one stream. Correct results, but nothing overlaps any more.
def fixed_pipeline(chunks, tl, stage_ms):
    stream = torch.cuda.Stream()
    tl.name_stream(stream, "producer and consumer")
    stream.wait_stream(torch.cuda.current_stream())
    outs = []
    for i, x in enumerate(chunks):
        with tl.span(f"produce {i}", stream=stream):
            y = events.produce(x, stage_ms)
        with tl.span(f"consume {i}", stream=stream):
            outs.append(events.consume(y, stage_ms))
    torch.cuda.current_stream().wait_stream(stream)
    return outs
