    # Wrong: the host waits for the producer's event (ready.synchronize) instead of the consumer stream.
    producer.wait_stream(torch.cuda.current_stream())
    outs = []
    for x in chunks:
        with torch.cuda.stream(producer):
            y = produce(x, stage_ms)
        ready = torch.cuda.Event()
        ready.record(producer)
        ready.synchronize()
        y.record_stream(consumer)
        with torch.cuda.stream(consumer):
            outs.append(consume(y, stage_ms))
    torch.cuda.current_stream().wait_stream(consumer)
    return outs
