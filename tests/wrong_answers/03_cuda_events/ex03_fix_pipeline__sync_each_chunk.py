# ruff: noqa: F821  (torch and events come from the notebook)
# Wrong: correct, but the host synchronises after every chunk, so the two streams take turns.
def fixed_pipeline(chunks, tl, stage_ms):
    producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()
    tl.name_stream(producer, "producer")
    tl.name_stream(consumer, "consumer")
    producer.wait_stream(torch.cuda.current_stream())
    outs = []
    for i, x in enumerate(chunks):
        with tl.span(f"produce {i}", stream=producer):
            y = events.produce(x, stage_ms)
        consumer.wait_stream(producer)
        with tl.span(f"consume {i}", stream=consumer):
            outs.append(events.consume(y, stage_ms))
        torch.cuda.synchronize()
    torch.cuda.current_stream().wait_stream(consumer)
    return outs
