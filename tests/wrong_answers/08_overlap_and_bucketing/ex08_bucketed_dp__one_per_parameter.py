        # WRONG (one bucket per parameter whatever the cap)
        self.module, self.world = module, dist.get_world_size()
        with torch.no_grad():
            for t in module.state_dict().values():  # parameters and buffers: every rank starts from rank 0's
                dist.broadcast(t, src=0)
        params = [p for p in module.parameters() if p.requires_grad]  # frozen ones never get a gradient
        cap = bucket_cap_mb * 2**20
        self.buckets, bucket, size = [], [], 0
        for p in reversed(params):  # backward produces the last layers' gradients first
            bucket.append(p)
            size += p.numel() * p.element_size()
            if True:
                self.buckets.append(bucket)
                bucket, size = [], 0
        if bucket:
            self.buckets.append(bucket)
        self.slot = {}  # parameter -> (bucket, offset in that bucket's flat buffer)
        self.flat = []
        for i, b in enumerate(self.buckets):
            offset = 0
            for p in b:
                self.slot[p] = (i, offset)
                offset += p.numel()
            self.flat.append(torch.zeros(offset, dtype=b[0].dtype, device=b[0].device))
        for p in params:
            p.register_post_accumulate_grad_hook(self._grad_ready)
        self.ready = [set() for _ in self.buckets]  # parameters whose gradient is in the bucket this step
        self.works = []  # the async all-reduce of each launched bucket, in bucket order
        ### NEXT SOLUTION
        i, offset = self.slot[param]
        self.flat[i][offset:offset + param.numel()].copy_(param.grad.reshape(-1))
        self.ready[i].add(param)
        # Launch full buckets in bucket order only, so every rank issues the same all-reduces in the same order.
        n = len(self.works)
        while n < len(self.buckets) and len(self.ready[n]) == len(self.buckets[n]):
            self.flat[n].div_(self.world)
            self.works.append(dist.all_reduce(self.flat[n], async_op=True))
            n += 1
        ### NEXT SOLUTION
        for i in range(len(self.works), len(self.buckets)):  # a bucket with a parameter unused this step
            for p in self.buckets[i]:
                if p not in self.ready[i]:  # no gradient this step: contribute zeros, not last step's values
                    offset = self.slot[p][1]
                    self.flat[i][offset:offset + p.numel()].zero_()
            self.flat[i].div_(self.world)
            self.works.append(dist.all_reduce(self.flat[i], async_op=True))
        for i, work in enumerate(self.works):
            work.wait()
            for p in self.buckets[i]:
                offset = self.slot[p][1]
                average = self.flat[i][offset:offset + p.numel()].view_as(p)
                if p.grad is None:
                    p.grad = average.clone()
                else:
                    p.grad.copy_(average)
        self.ready = [set() for _ in self.buckets]
        self.works = []
