        # WRONG (every group stepped with the constructor's lr, betas, eps and weight_decay)
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        groups = list(params)
        if not groups or not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        self.groups, pieces = [], []
        for g in groups:
            params = [p for p in g["params"] if p.requires_grad]
            if not params:
                continue
            n = sum(p.numel() for p in params)
            shard = -(-n // self.world)
            flat = torch.cat([p.detach().reshape(-1) for p in params])
            mine = torch.zeros(shard)
            lo, hi = self.rank * shard, min((self.rank + 1) * shard, n)
            mine[:max(hi - lo, 0)] = flat[lo:hi]
            piece = nn.Parameter(mine)
            self.groups.append((params, n, shard, piece))
            pieces.append(piece)
        self.adam = torch.optim.Adam(pieces, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        ### NEXT SOLUTION
        for params, _, _, _ in self.groups:
            for p in params:
                p.grad = None
        ### NEXT SOLUTION
        for params, n, shard, piece in self.groups:
            grads = torch.zeros(self.world * shard)
            grads[:n] = torch.cat([p.grad.reshape(-1) for p in params])
            mine = torch.empty(shard)
            reduce_scatter_tensor(mine, grads)
            piece.grad = mine.div_(self.world)
        self.adam.step()
        with torch.no_grad():
            for params, n, shard, piece in self.groups:
                whole = torch.empty(self.world * shard)
                all_gather_into_tensor(whole, piece.detach())
                offset = 0
                for p in params:
                    p.copy_(whole[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()
