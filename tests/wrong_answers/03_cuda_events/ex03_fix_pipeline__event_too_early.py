# ruff: noqa: F821  (torch and events come from the notebook)
# Wrong: the event is recorded before the producer's work is queued, so waiting on it orders nothing.
def fixed_pipeline(chunks, tl, stage_ms):
    producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()
    tl.name_stream(producer, "producer")
    tl.name_stream(consumer, "consumer")
    producer.wait_stream(torch.cuda.current_stream())
    outs = []
    for i, x in enumerate(chunks):
        ready = torch.cuda.Event()
        ready.record(producer)
        with tl.span(f"produce {i}", stream=producer):
            y = events.produce(x, stage_ms)
        consumer.wait_event(ready)
        with tl.span(f"consume {i}", stream=consumer):
            outs.append(events.consume(y, stage_ms))
    torch.cuda.current_stream().wait_stream(consumer)
    return outs
