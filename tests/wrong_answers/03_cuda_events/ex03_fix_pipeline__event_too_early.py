    # Wrong: the event is recorded before the producer's work is queued, so waiting on it orders nothing.
    producer.wait_stream(torch.cuda.current_stream())
    outs = []
    for x in chunks:
        ready = torch.cuda.Event()
        ready.record(producer)
        with torch.cuda.stream(producer):
            y = produce(x, stage_ms)
        consumer.wait_event(ready)
        y.record_stream(consumer)
        with torch.cuda.stream(consumer):
            outs.append(consume(y, stage_ms))
    torch.cuda.current_stream().wait_stream(consumer)
    return outs
