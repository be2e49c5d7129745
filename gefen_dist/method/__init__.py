"""The method, free of any backend or framework: how a tensor is cut into pieces
(``segments``), which block sizes its g0² chooses (``partition``), the DP codebook of m
(``codebook``), codes and the counter hash (``codes``), the state's layout and its checks at
load (``state``, ``load_check``), a param group's values at a step (``hyper``), and the update
stated plainly per tensor (``spec``)."""
