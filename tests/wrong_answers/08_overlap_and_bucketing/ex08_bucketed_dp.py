        # WRONG (waits inside the hook: no overlap)
        self.world = dist.get_world_size()
        with torch.no_grad():
            for t in module.state_dict().values():  # parameters and buffers: every rank starts from rank 0's
                dist.broadcast(t, src=0)
        params = [p for p in module.parameters() if p.requires_grad]  # parameters() lists a tied one once
        cap = bucket_cap_mb * 2**20
        self.buckets, bucket, size = [], [], 0
        for p in reversed(params):  # backward produces the last layers' gradients first
            bucket.append(p)
            size += p.numel() * p.element_size()
            if size >= cap:
                self.buckets.append(bucket)
                bucket, size = [], 0
        if bucket:
            self.buckets.append(bucket)
        self.flat, self.bucket_of, self.view = [], {}, {}  # a flat buffer per bucket; each parameter's place
        for i, b in enumerate(self.buckets):
            self.flat.append(torch.zeros(sum(p.numel() for p in b), dtype=b[0].dtype, device=b[0].device))
            offset = 0
            for p in b:
                self.bucket_of[p] = i
                self.view[p] = self.flat[i][offset:offset + p.numel()].view_as(p)  # made once, not per step
                offset += p.numel()
        for p in params:
            p.register_post_accumulate_grad_hook(self._grad_ready)
        self.ready = [set() for _ in self.buckets]  # parameters whose gradient is in the buffer this step
        self.works = []  # the all-reduce of each bucket launched so far, in bucket order
        ### NEXT SOLUTION
        i = self.bucket_of[param]
        self.view[param].copy_(param.grad)
        self.ready[i].add(param)
        n = len(self.works)  # launch full buckets in bucket order only: every rank issues the same sequence
        while n < len(self.buckets) and len(self.ready[n]) == len(self.buckets[n]):
            self.flat[n].div_(self.world)
            work = dist.all_reduce(self.flat[n], async_op=True)
            work.wait()  # waits inside the hook: backward stalls until every rank got here
            self.works.append(work)
            n += 1
        ### NEXT SOLUTION
        for i in range(len(self.works), len(self.buckets)):  # buckets a parameter unused this step left open
            for p in self.buckets[i]:
                if p not in self.ready[i]:  # no gradient this step: contribute zeros, not last step's values
                    self.view[p].zero_()
            self.flat[i].div_(self.world)
            self.works.append(dist.all_reduce(self.flat[i], async_op=True))
        for i, work in enumerate(self.works):
            work.wait()
            for p in self.buckets[i]:
                if p.grad is None:
                    p.grad = self.view[p].clone()
                else:
                    p.grad.copy_(self.view[p])
        self.ready = [set() for _ in self.buckets]
        self.works = []
