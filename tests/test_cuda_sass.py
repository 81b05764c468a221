"""tools/cuda_sass.py's reading of cuobjdump output: kernels by name, basic blocks split at branches and their
targets, opcodes without predicate guards or modifiers (a hand-written listing in cuobjdump's format)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import cuda_sass  # noqa: E402

LISTING = """
        Function : _Z3fooPf
        .headerflags    @"EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                   /* 0x00000a00ff017b82 */
        /*0010*/                   LDS.128 R4, [R2+0x10] ;                  /* 0x0000100002047984 */
        /*0020*/                   HMMA.16816.F32 R8, R4, R6, R8 ;          /* 0x000000060408723c */
        /*0030*/              @!P0 BRA 0x20 ;                               /* 0xfffffffc00008947 */
        /*0040*/                   HMMA.16816.F32 R8, R4, R6, R8 ;          /* 0x000000060408723c */
        /*0050*/                   EXIT ;                                   /* 0x000000000000794d */
        ..........

        Function : _Z3barv
        /*0000*/                   EXIT ;                                   /* 0x000000000000794d */
"""


def test_kernels_blocks_and_opcodes():
    ks = cuda_sass.kernels(LISTING)
    assert list(ks) == ["_Z3fooPf", "_Z3barv"]
    foo = ks["_Z3fooPf"]
    assert [a for a, _ in foo] == [0x0, 0x10, 0x20, 0x30, 0x40, 0x50]
    assert [cuda_sass.opcode(i) for _, i in foo] == ["LDC", "LDS", "HMMA", "BRA", "HMMA", "EXIT"]
    # 0x20 is a branch target: a block starts there; the branch and the exit end theirs
    blocks = cuda_sass.basic_blocks(foo)
    assert [[a for a, _ in b] for b in blocks] == [[0x0, 0x10], [0x20, 0x30], [0x40, 0x50]]


def test_compare_names_same_code_and_moved_opcodes(capsys):
    """--against's report: a kernel whose instructions are the same (addresses aside) is said to be; one with an
    instruction swapped reports the counts of the opcodes that moved; a kernel only on one side is new or gone."""
    old = cuda_sass.kernels(LISTING)
    new = cuda_sass.kernels(LISTING.replace("LDS.128 R4, [R2+0x10]", "LDG.E.128 R4, desc[UR4][R2.64+0x10]")
                            .replace("_Z3barv", "_Z3bazv"))
    assert cuda_sass.compare(old, old, "foo", "HEAD~1") == 0
    assert capsys.readouterr().out == "_Z3fooPf: the same 6 instructions\n"
    cuda_sass.compare(old, new, ".", "HEAD~1")
    out = capsys.readouterr().out.splitlines()
    assert out == ["_Z3barv: gone", "_Z3bazv: new", "_Z3fooPf: 6 -> 6 instructions; LDG 0->1, LDS 1->0"]
    assert cuda_sass.compare(old, new, "nothing", "HEAD~1") == 1
