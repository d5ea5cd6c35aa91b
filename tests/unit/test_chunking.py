from strata.engine.chunking import prefill_piece


def test_pieces_are_whole_and_wait_unless_first():
    assert prefill_piece(5000, 2048, 8000, False, False) == 2048  # a whole piece
    assert prefill_piece(300, 2048, 8000, False, False) == 300  # the prompt's rest
    assert (
        prefill_piece(2048, 2048, 1000, False, False) == 0
    )  # does not fit: waits, not cut
    assert (
        prefill_piece(2048, 2048, 1000, False, True) == 1000
    )  # the step's first piece is cut to fit
    assert prefill_piece(300, 2048, 1000, False, False) == 300


def test_without_chunking_the_rest_goes_whole():
    assert prefill_piece(5000, 0, 8000, False, True) == 5000
    assert prefill_piece(9000, 0, 8000, False, True) == 0  # too big beside others
    assert (
        prefill_piece(9000, 0, 8000, True, True) == 9000
    )  # alone it may exceed the budget
