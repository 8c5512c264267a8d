package cuda

import (
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"
)

// ncclCommInitRank takes ncclUniqueId (char internal[128]) by value: the
// Go struct must be exactly its size, with no padding, for purego to pass
// it in memory as the C compiler does.
func TestNCCLUniqueIDLayout(t *testing.T) {
	require.Equal(t, uintptr(NCCLIDSize), unsafe.Sizeof(ncclUniqueID{}))
	require.Equal(t, uintptr(1), unsafe.Alignof(ncclUniqueID{}))
}

func TestNCCLErrorNames(t *testing.T) {
	n := &ncclLib{}
	err := n.check("ncclAllReduce", 6, 0)
	require.EqualError(t, err, "nccl: ncclAllReduce: ncclRemoteError (6)")
	require.NoError(t, n.check("ncclAllReduce", ncclSuccess, 0))
}
