        # WRONG (whole states: grads averaged with reduce-scatter + all-gather, then Adam on every parameter)
        self.world = dist.get_world_size()
        groups = list(params)
        if not groups or not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        self.params = [p for g in groups for p in g["params"] if p.requires_grad]
        # torch.optim.Adam takes the groups as they are; the ranks only have to agree on the gradients
        self.adam = torch.optim.Adam(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        ### NEXT SOLUTION
        for p in self.params:
            p.grad = None
        ### NEXT SOLUTION
        n = sum(p.numel() for p in self.params)
        shard = -(-n // self.world)
        flat = torch.zeros(self.world * shard)
        flat[:n] = torch.cat([p.grad.reshape(-1) for p in self.params])
        mine = torch.empty(shard)
        reduce_scatter_tensor(mine, flat)  # my shard of the summed gradients
        mine /= self.world
        all_gather_into_tensor(flat, mine)  # everyone's averaged shards: the whole averaged gradient
        offset = 0
        for p in self.params:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        self.adam.step()  # the same step on every rank
