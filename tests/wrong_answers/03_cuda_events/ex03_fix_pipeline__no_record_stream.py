    # Wrong: ordered on the GPU, but y's memory goes back to the producer stream while the consumer still
    # has to read it (no record_stream, no reference kept).
    producer.wait_stream(torch.cuda.current_stream())
    outs = []
    for x in chunks:
        with torch.cuda.stream(producer):
            y = produce(x, stage_ms)
        ready = torch.cuda.Event()
        ready.record(producer)
        consumer.wait_event(ready)
        with torch.cuda.stream(consumer):
            outs.append(consume(y, stage_ms))
    torch.cuda.current_stream().wait_stream(consumer)
    return outs
