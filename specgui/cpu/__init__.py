"""On a CPU: decoder layers in C over row-independent products, the matmul forms measured per shape, grouped attention
without copies, the weights in one aligned arena."""
